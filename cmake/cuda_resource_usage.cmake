# Runs nvcc with --resource-usage on one .cu file and writes what ptxas printed to OUTPUT.
# Inputs: NVCC, FLAGS (a list), SOURCE, OUTPUT.
execute_process(
  COMMAND ${NVCC} ${FLAGS} --resource-usage -c ${SOURCE} -o /dev/null
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "nvcc --resource-usage failed on ${SOURCE}:\n${out}\n${err}")
endif()
file(WRITE ${OUTPUT} "# source: ${SOURCE}\n${out}${err}")
